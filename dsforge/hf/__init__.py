"""Hugging Face model folders from dsforge checkpoints (Llama for dense models, Mixtral for
models whose every layer is MoE), and back.

- names.py: the tensor map dsforge global names <-> Hugging Face names, both directions;
- config.py: what can be exported (`exportable`), config.json and generation_config.json;
- shards.py: a streaming safetensors writer (headers from shapes, tensors one at a time);
- tokenizer.py: the tokenizer files a model folder carries;
- export.py: `dsforge export` (checkpoint -> OUT.partial -> OUT);
- load.py: a folder's tensors (checked first by recipe/init_from.py, rules I1-I5) as dsforge global tensors, one at a time (runtime/assemble/init.py).
Design notes and the derivation of the map: docs/design/checkpoints-plan.md sections 3-4;
user documentation: docs/export.md.
"""
