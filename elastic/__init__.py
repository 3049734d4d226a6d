"""Elastic runs: ``autopar run --elastic`` (the ``run`` verb's module, ``run_cli``).

This package sits above the runtime and the planner, which never import it: when the nodes of
a run change, it re-plans through the planner and resumes through the runtime.

* ``run_cli``     -- the ``autopar run`` verb: the runtime's ``run_launch.launch``, or with ``--elastic`` ``orchestrate``
* ``orchestrate`` -- launches one torchrun agent per node, again after a failure; the exit codes
* ``agent``       -- torchrun's agent exporting the rendezvous round; a failed rendezvous as one line
* ``worker``      -- each rank: the round agrees on its plan, then ``python -m autopar.runtime``
* ``switches``    -- the run's state under CHECKPOINT_DIR/elastic: re-plans, switches, their times
"""
