"""The rules on the data section that need the files it names (D2-D4, D6's second half, D7-D16),
one module for each kind of data or file the section names.

What data.source names decides which rules apply (kind.py tells the kinds apart):
- "synthetic": D15 (a tokenizer is pointless; tokenizers.py). Validation draws held-out
  samples from a second seeded stream, so train.eval_every works.
- a flat token file (a string naming an existing file that is not a dataset's .bin or .idx):
  D2-D4 and its split, D10/D11 (token_file.py); D12/D14 for data.tokenizer (tokenizers.py).
- a Megatron dataset prefix or a blend of them: D7-D9 (datasets.py), D10/D11 and D6 for a
  split that Megatron-Core reads differently from dsforge (splits.py), D12-D14
  (tokenizers.py), D16 (cache_dir.py). Blend parts of weight 0 are left out, as the runtime
  leaves them out (data/samples.py).
- D17 for any kind: packed documents need an end-of-document id and a kernel that takes a
  mask (documents.py).

A dataset is checked from its .idx (memory-mapped by Megatron-Core's own IndexedDataset), the
size of its .bin and its PREFIX.tokenizer.json record: never its tokens, so a 100 GB corpus
validates in seconds. Validation runs again for every value a fix suggests (recipe/fixes.py):
what is read is cached by path, size and modification time. megatron.core takes seconds to
import; it is imported only when a recipe names a dataset.
"""

from __future__ import annotations

from dsforge.recipe.data_rules import (cache_dir, datasets, documents, splits, token_file,
                                      tokenizers)
from dsforge.recipe.fixes import Rule

DATA_RULES: tuple[Rule, ...] = (
    token_file.token_file, datasets.dataset_files, splits.dataset_splits, tokenizers.tokenizer,
    cache_dir.cache_dir, documents.documents,
)
