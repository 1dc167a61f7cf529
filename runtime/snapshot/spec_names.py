"""How a snapshot's tree spec names things, without torch: the path segment of a key
(``escape_segment``) and the DTensor node tag. The launcher reads specs (a rank's
replicated-state digests name their tensors by these paths) and must not import torch,
which ``state_tree`` and ``dtensor`` need (the launcher imports torch only for its
TCPStore, on a thread while etcd and Ray start: ``services.stack.prefetch_torch``)."""
from __future__ import annotations

import re

DTENSOR_TAG = "dtensor"
_INT_LIKE = re.compile(r"-?[0-9]+")


def escape_segment(key: str | int) -> str:
    """One path segment: ints print as decimal; strs escape ``~``→``~0``, ``/``→``~1`` and
    get a ``~s`` prefix when they would read as an int (so 0 and "0" never collide)."""
    if isinstance(key, int):
        return str(key)
    text = key.replace("~", "~0").replace("/", "~1")
    return "~s" + text if text == "" or _INT_LIKE.fullmatch(text) else text
