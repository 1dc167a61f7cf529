"""Deterministic data-parallel training of a small transformer language model on synthetic
tokens, with Adam: the heavier example of ``bench/vs_torchrun.py``.

With the defaults the parameters take ~90 MiB and Adam's two moments twice that, so each
rank's training state is ~270 MiB, while a step stays cheap on a CPU (a batch of 30
tokens; most parameters are the embedding and the output projection).

Each rank draws its tokens from a generator seeded by (seed, rank, step): sequences that
follow ``next = (5 * token + 3) % vocab`` from a random start, so the loss falls as the model
learns the rule. Gradients are averaged by ``DistributedDataParallel``. Adam's state is created zeroed
before the first step, so it exists in the first snapshot (and a checkpoint loader finds
every key). Prints and returns the sha256 of the final parameters.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import phalanx
if __package__:              # imported as examples.train_transformer
    from .step_log import StepLog
    from .train_mlp import parameter_hash
else:                        # run as a script: its folder is importable, as with `python`
    from step_log import StepLog
    from train_mlp import parameter_hash

MiB = 1 << 20
DEFAULTS = {"vocab": 32768, "d_model": 320, "layers": 2, "heads": 4, "seq_len": 16}


class TinyLM(nn.Module):
    """Token and position embeddings, ``layers`` pre-norm causal transformer blocks, a final
    norm and an untied output projection. No dropout: every run computes the same thing."""

    def __init__(self, vocab: int, d_model: int, layers: int, heads: int, seq_len: int,
                 seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq_len, d_model) * 0.02)
        block = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=4 * d_model,
                                           dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len),
                             persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        h = self.embed(tokens) + self.pos[:length]
        h = self.blocks(h, mask=self.mask[:length, :length], is_causal=True)
        return self.head(self.norm(h))


def make_model(seed: int, vocab: int = DEFAULTS["vocab"], d_model: int = DEFAULTS["d_model"],
               layers: int = DEFAULTS["layers"], heads: int = DEFAULTS["heads"],
               seq_len: int = DEFAULTS["seq_len"]) -> TinyLM:
    return TinyLM(vocab, d_model, layers, heads, seq_len, seed)


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.Adam:
    """Adam (the fused CPU kernel: twice as fast as the default here) with its state created
    zeroed for every parameter, as its first step would."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, fused=True)
    for p in model.parameters():
        optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                              "exp_avg_sq": torch.zeros_like(p)}
    return optimizer


def batch(seed: int, rank: int, step: int, batch_size: int, seq_len: int,
          vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + step)
    start = torch.randint(0, vocab, (batch_size, 1), generator=gen)
    tokens = [start]
    for _ in range(seq_len - 1):
        tokens.append((tokens[-1] * 5 + 3) % vocab)
    return torch.cat(tokens, dim=1)


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                       tokens[:, 1:].reshape(-1))


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters plus optimizer tensors: what a snapshot or checkpoint holds."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for state in optimizer.state.values():
        total += sum(t.numel() * t.element_size() for t in state.values()
                     if isinstance(t, torch.Tensor))
    return total


def main(steps: int = 40, batch_size: int = 2, lr: float = 1e-3, seed: int = 0,
         vocab: int = DEFAULTS["vocab"], d_model: int = DEFAULTS["d_model"],
         layers: int = DEFAULTS["layers"], heads: int = DEFAULTS["heads"],
         seq_len: int = DEFAULTS["seq_len"], step_log: str = "") -> dict:
    """``step_log``: a path prefix for per-step timings (see ``step_log.py``)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    session = phalanx.Session()
    model = DDP(make_model(seed, vocab, d_model, layers, heads, seq_len))
    optimizer = make_optimizer(model, lr)
    session.register(model=model, optimizer=optimizer)
    nbytes = state_bytes(model, optimizer)
    loss = torch.zeros(())
    with session:
        started = time.perf_counter()
        log = StepLog(step_log)
        while session.step_index < steps:
            log.begin()
            with session.step() as step:
                tokens = batch(seed, session.rank, step, batch_size, seq_len, vocab)
                optimizer.zero_grad(set_to_none=False)
                loss = loss_of(model, tokens)
                loss.backward()
                optimizer.step()
            log.end(session, step)
        seconds = time.perf_counter() - started
        digest = parameter_hash(model)
    print(f"rank {session.rank} trained {steps} steps in {seconds:.3f} s, state "
          f"{nbytes / MiB:.1f} MiB, loss {float(loss):.4f}", flush=True)
    print(f"rank {session.rank} final parameter hash {digest}", flush=True)
    log.write(session.rank)
    return {"hash": digest, "steps": steps, "loss": float(loss.detach()), "seconds": seconds,
            "state_bytes": nbytes}


if __name__ == "__main__":
    main()
