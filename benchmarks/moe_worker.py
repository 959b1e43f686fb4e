"""One run of the mixture-of-experts comparison: ``recipes.lm`` on a Qwen3-MoE on 2 DDP ranks,
its experts whole on every rank or split over them (expert parallelism).

``torchrun --nproc-per-node 2 -m benchmarks.moe_worker --ep-size 1|2 [--quick]``. Prints
``BENCH_RESULT {"step_time_s": ...}``.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import torch

from benchmarks.lm_recipe_worker import make_corpus
from benchmarks.loops.trainer_loop import StepClock
from benchmarks.probe import StepTimer, emit, exit_now, use_one_thread
from gangs import setup_root_gang

SEQ_LEN = 256
BATCH_SIZE = 4
NUM_EXPERTS = 8


def make_model_dir(scratch: Path, quick: bool) -> tuple[Path, Path]:
    """A Qwen3-MoE of 2 layers of 128, 8 experts of 128 (top-2), saved per expert as
    ``save_pretrained`` saves it, beside the corpus's tokenizer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    corpus, tokenizer = make_corpus(scratch, num_documents=120 if quick else 500)
    model_dir = scratch / "model"
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=128,
        intermediate_size=384,
        moe_intermediate_size=128,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=False,
    )
    Qwen3MoeForCausalLM(config).save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(scratch / name, model_dir / name)
    return model_dir, corpus


def main() -> None:
    from gangs import setup_parallel_gangs
    from recipes.lm import LMConfig, build_trainer
    from runtime.cli.config import load_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep-size", type=int, required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    use_one_thread()
    steps, warmup = (12, 4) if args.quick else (60, 10)
    scratch = Path(os.environ["BENCH_SCRATCH"])
    root = setup_root_gang()
    if root.rank == 0:
        make_model_dir(scratch, args.quick)
    root.barrier()
    config = load_config(
        LMConfig,
        overrides=[
            f"model.hf_path={scratch / 'model'}",
            f"data.train={scratch / 'train.jsonl'}",
            f"data.seq_len={SEQ_LEN}",
            f"data.batch_size={BATCH_SIZE}",
            "data.num_workers=0",
            "data_parallel=ddp",
            f"gang.ep_size={args.ep_size}",
            f"trainer.max_num_steps={steps}",
            f"trainer.publish_metrics_every_n_steps={steps}",
            f"trainer.checkpoint_every_n_steps={steps}",
            "trainer.max_gradient_norm=1.0",
        ],
    )
    timer = StepTimer(num_warmup=warmup, num_steps=steps)
    trainer = build_trainer(
        config, scratch / "run", setup_parallel_gangs(root, ep_size=args.ep_size)
    )
    trainer.add_callback(StepClock(timer))
    trainer.run()
    emit({"step_time_s": timer.seconds_per_step()})
    exit_now()


if __name__ == "__main__":
    main()
