"""Models users compose, one subpackage or module each:

- :mod:`models.hf`: Hugging Face causal LMs of any family from a local directory (built on meta,
  tensor-parallel plans, the per-expert conversion of their files, export);
- :mod:`models.llama`: the project's Llama-style model;
- :mod:`models.lora`: LoRA adapters through peft, and the exports of a LoRA run;
- :mod:`models.moe`: the mixture-of-experts pieces (aux loss, expert parallelism, load metrics,
  aux-loss-free balancing, the MoE LM unit);
- :mod:`models.blocks` and :mod:`models.flops`: what the runtime asks of any of them, their
  decoder layers and their FLOPs per token.

Nothing is imported here, so that one piece (the conversion the runtime's loading needs, say)
costs only its own imports.
"""
