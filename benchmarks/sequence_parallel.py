"""What sequence parallelism saves and costs per rank, on CPU: the activations a training step
keeps for its backward, the step time, and the all-to-all volume a layer.

Usage: ``torchrun --nproc-per-node SP benchmarks/sequence_parallel.py SEQ_LEN...`` (SP 1, 2, 4;
``python benchmarks/sequence_parallel.py SEQ_LEN...`` for SP 1). Rank 0 prints one JSON line a
sequence length. The model is the project's Llama, small (dim 128, 8 heads, 2 key/value heads,
2 layers), one sequence a step, causal attention, float32.

The activations are the bytes of the distinct storages autograd saves for the backward during
the forward (``saved_tensors_hooks``): what a step holds at its peak beyond the parameters, the
gradients and the optimizer state, which SP leaves as they are (FSDP2 shards those over DP x SP).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

import runtime.parallel.sequence as sequence
from gangs import Gangs, setup_gangs
from models.llama import Llama, LlamaArgs
from runtime.parallel.sequence import apply_sequence_parallel

ARGS = LlamaArgs(
    vocab_size=256, dim=128, num_layers=2, num_heads=8, num_kv_heads=2, ffn_dim=384, max_seq_len=1
)
STEPS = 2


def measure(gangs: Gangs, seq_len: int) -> dict[str, Any]:
    sp, rank = gangs.sp.size, gangs.sp.rank
    torch.manual_seed(0)
    model = apply_sequence_parallel(Llama(ARGS), gangs)
    tokens = torch.randint(0, ARGS.vocab_size, (1, seq_len + 1), generator=torch.Generator())
    n = seq_len // sp
    part = slice(rank * n, (rank + 1) * n)
    inputs, targets = tokens[:, :-1][:, part], tokens[:, 1:][:, part]
    positions = torch.arange(seq_len)[None, part]

    sent = [0]
    inner = sequence.all_to_all_dim0

    def counting(x: torch.Tensor, group: Any) -> torch.Tensor:
        sent[0] += x.numel() * x.element_size() * (sp - 1) // sp
        return inner(x, group)

    sequence.all_to_all_dim0 = counting  # type: ignore[assignment]

    def step() -> int:
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(inputs, position_ids=positions)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        loss.backward()
        return sum(storages.values())

    activations = step()  # warm-up
    sent[0] = 0
    start = time.perf_counter()
    for _ in range(STEPS):
        step()
    seconds = (time.perf_counter() - start) / STEPS
    sequence.all_to_all_dim0 = inner  # type: ignore[assignment]
    return {
        "seq_len": seq_len,
        "sp_size": sp,
        "activation_mib_per_rank": round(activations / 2**20, 1),
        "step_seconds": round(seconds, 3),
        # The forward's four all-to-alls; the backward sends as much again.
        "all_to_all_mib_sent_per_layer_per_rank": round(
            sent[0] / STEPS / ARGS.num_layers / 2**20, 2
        ),
    }


if __name__ == "__main__":
    torch.set_num_threads(1)
    the_gangs = setup_gangs(sp_size=int(os.environ.get("WORLD_SIZE", "1")))
    for value in sys.argv[1:]:
        result = measure(the_gangs, int(value))
        if the_gangs.root.rank == 0:
            print(json.dumps(result), flush=True)
    the_gangs.root.close()
