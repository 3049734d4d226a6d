"""The step: the layer table, the step model, overlap and the trace."""
