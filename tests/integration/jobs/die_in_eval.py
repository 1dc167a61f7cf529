"""examples/ddp_phalanx.py whose rank 1 SIGKILLs itself inside the evaluation that follows
epoch ``--die-in-eval`` (0-based), once per ``--marker`` file: the survivor's evaluation
collectives fail between two epochs, outside any step, and the spare that takes rank 1
must not die again. Without ``--die-in-eval`` it is the example itself."""
import argparse
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))    # the repository's root

import torch.distributed as dist  # noqa: E402

from examples import ddp_phalanx  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--die-in-eval", type=int, default=-1)
    parser.add_argument("--marker", default="")
    ours, sys.argv[1:] = parser.parse_known_args()
    evaluate, calls = ddp_phalanx.evaluate, [0]

    def dying(model, loader, group=None):
        calls[0] += 1
        if calls[0] == ours.die_in_eval + 1 and dist.get_rank() == 1 \
                and not os.path.exists(ours.marker):
            Path(ours.marker).touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return evaluate(model, loader, group)

    ddp_phalanx.evaluate = dying
    ddp_phalanx.main()


if __name__ == "__main__":
    main()
