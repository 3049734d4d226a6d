"""The device and its cost model: profiles, calibration, the network and topology, op costs."""
