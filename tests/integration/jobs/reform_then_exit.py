"""One rank that forms its gloo group, re-forms it (abandon + form) a few times and exits
the moment the last re-form returned, through the interpreter's normal shutdown, while the
reaper thread may still be tearing the previous group down (tests/integration/
test_group_exit.py). A fresh interpreter per rank: a rank forked from a process that had
imported torch did not show the abort this guards against."""
import argparse
import datetime

import torch
import torch.distributed as dist

from phalanx.runtime.group.collective import Collective

parser = argparse.ArgumentParser()
parser.add_argument("--rank", type=int, required=True)
parser.add_argument("--port", type=int, required=True)
parser.add_argument("--reforms", type=int, default=3)
args = parser.parse_args()


def connect() -> dist.Store:
    return dist.TCPStore("127.0.0.1", args.port, is_master=False,
                         timeout=datetime.timedelta(seconds=30))


collective = Collective(connect, rank=args.rank, world_size=2, timeout_s=20.0)
collective.form(0)
for generation in range(1, args.reforms + 1):
    collective.all_reduce(torch.ones(4), lambda: False)
    collective.abandon()
    collective.form(generation)
# ends here, at once: the interpreter's shutdown meets the reaper of the last re-form
