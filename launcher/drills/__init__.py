"""Drills: fault injection into a live job. Scenarios (YAML), the fault catalogue, the
injector that fires faults from the launcher, the ``phalanx drill`` commands, chaos runs,
reports and plots, and the helpers some faults need (a link proxy, a local S3). The job
core reaches drills only through the seam in ``launcher.drills.seam``.
"""
