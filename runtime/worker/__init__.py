"""Everything inside a training process: the ``Session`` a loop uses, what the launcher
tells the process (``context``), the entrypoint loader, the heartbeat, the link to the
node keeper, and how a rank joins a new generation (``rejoin``).
"""
