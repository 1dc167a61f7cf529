"""Fixtures that check a test left nothing behind (processes, shm segments, temp dirs)."""
