"""The byte-level tokenizer (dsforge.tokenizer) and the token file tools/tokenize_text.py makes
with it."""

from __future__ import annotations

import subprocess
import sys

from dsforge import tokenizer
from tests.conftest import REPO


def test_byte_tokenizer_round_trips():
    text = "Full fathom five thy father lies — é"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_shipped_token_file_is_the_tokenized_text(tmp_path):
    out = tmp_path / "t.bin"
    subprocess.run([sys.executable, str(REPO / "tools" / "tokenize_text.py"),
                    str(REPO / "data" / "tempest.txt"), str(out)], check=True, capture_output=True)
    assert out.read_bytes() == (REPO / "data" / "tempest.u16.bin").read_bytes()
    assert not (tmp_path / "t.bin.partial").exists()
