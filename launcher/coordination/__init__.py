"""The launcher as coordinator: turns what it observes (actor deaths, leases, node watch,
progress, replica digests) into detection signals, executes recovery plans, tracks the
commit point, and holds or hands over leadership of the job.
"""
