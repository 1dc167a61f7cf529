"""The training process group across generations: one gloo group per generation on the
launcher's TCPStore, and the all-reduce that is abandoned, never awaited, when the
generation changes under it.
"""
