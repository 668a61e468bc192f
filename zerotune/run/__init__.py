"""Where and how experiments run: device slots, the scheduler, the experiment directory and its
record, process cleanup, backends."""
