"""Where and how experiments run: device slots, the scheduler, process cleanup, backends."""
