"""Corpora and tokenizers, beside the recipe path (preparing a corpus runs no rank).

- tokenizers.py: a local Hugging Face tokenizer or the byte-level one, with its identity
- inputs.py: which files INPUT... names; their documents as ordered batches
- prepare.py: `dsforge data prepare`, the pipeline to a Megatron indexed dataset
- identity.py: the PREFIX.tokenizer.json record beside a prepared dataset
- indexed.py: opening a prepared dataset (dsforge's or Megatron-LM's / GPT-NeoX's)
"""
