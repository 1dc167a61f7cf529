"""nanoGPT's training loop (karpathy/nanoGPT ``train.py``), tiny and on CPU/gloo, made fault
tolerant. What it keeps from nanoGPT: ``get_batch()`` draws from the global RNG; the first
batch is fetched before the loop and the next one prefetched inside it; gradient
accumulation by ``model.require_backward_grad_sync``; a ``GradScaler``; a cosine LR set by
hand from the iteration; ``estimate_loss()`` every ``eval_interval`` on the master only (no
collective); ``raw_model = model.module``. What phalanx needs: the Session, the loop over
``session.step_index``, and the prefetched batch in ``session.extras`` (loop state carried
from one iteration into the next):

    torchrun --nproc-per-node 2 examples/train_nanogpt.py
    phalanx drill run configs/drills/kill_worker.yaml --config configs/nanogpt.yaml --verify

Prints ``rank R final parameter hash H`` (the sha256 of its parameters) at the end.
"""
import hashlib
import math
import os
import time

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed import init_process_group, destroy_process_group
import phalanx

block_size, batch_size, vocab = 16, 4, 64
gradient_accumulation_steps = 2
max_iters, eval_interval, eval_iters = 60, 20, 3
learning_rate, min_lr, warmup_iters, lr_decay_iters = 1e-2, 1e-3, 5, 60

init_process_group(backend="gloo")
ddp_rank = int(os.environ["RANK"])
master_process = ddp_rank == 0
torch.manual_seed(1337 + ddp_rank)
data = torch.randint(0, vocab, (5000,), generator=torch.Generator().manual_seed(0))


def get_batch(split):
    ix = torch.randint(len(data) - block_size - 1, (batch_size,))
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x, y


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(vocab, 32)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.head = nn.Linear(32, vocab)

    def forward(self, idx, targets=None):
        h = self.emb(idx)
        logits = self.head(h + self.mlp(h))
        loss = F.cross_entropy(logits.view(-1, vocab), targets.view(-1))
        return logits, loss


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * min(decay_ratio, 1.0)))
    return min_lr + coeff * (learning_rate - min_lr)


model = GPT()
scaler = torch.amp.GradScaler("cpu", enabled=False)
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.95))
model = DDP(model)
raw_model = model.module


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            _, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


session = phalanx.Session()
session.register(model=model, optimizer=optimizer, scaler=scaler)
X, Y = get_batch("train")           # fetch the very first batch
# the prefetched batch lives across steps: state of the loop, restored with the rest
session.extras["X"], session.extras["Y"] = X.tolist(), Y.tolist()
with session:
    while session.step_index < max_iters:
        with session.step() as iter_num:
            X, Y = torch.tensor(session.extras["X"]), torch.tensor(session.extras["Y"])
            lr = get_lr(iter_num)
            for param_group in optimizer.param_groups:
                param_group["lr"] = lr
            if iter_num % eval_interval == 0 and master_process:
                losses = estimate_loss()
                print(f"step {iter_num}: train loss {losses['train']:.4f}, "
                      f"val loss {losses['val']:.4f}")
            for micro_step in range(gradient_accumulation_steps):
                model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
                logits, loss = model(X, Y)
                loss = loss / gradient_accumulation_steps
                X, Y = get_batch("train")
                scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            session.extras["X"], session.extras["Y"] = X.tolist(), Y.tolist()
            time.sleep(0.05)
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                             for p in raw_model.parameters())).hexdigest()
print(f"rank {ddp_rank} final parameter hash {digest}", flush=True)
destroy_process_group()
