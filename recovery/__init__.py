"""Recovery, decided purely: fault reports, detection, plan types, the planner and the
coordinator's phases. No torch, no Ray, no I/O."""
