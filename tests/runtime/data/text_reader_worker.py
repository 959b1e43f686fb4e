"""TextDataReader under ``torchrun``: each rank writes its sequences of 3 steps and its state.

Usage: ``torchrun --nproc-per-node 2 tests/runtime/data/text_reader_worker.py DATA_DIR OUT``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from gangs import setup_gangs
from runtime.data.text import ByteTokenizer, TextDataReader, TextSource


def main(data_dir: str, output_dir: Path) -> None:
    dp = setup_gangs().dp
    reader = TextDataReader(
        sources=[TextSource(f"{data_dir}/a*.jsonl", 2.0), TextSource(f"{data_dir}/b*.jsonl", 1.0)],
        tokenizer=ByteTokenizer(),
        seq_len=12,
        batch_size=2,
        num_accumulate=2,
        gang=dp,
        num_workers=1,
        chunk_bytes=256,
    )
    steps = [next(reader) for _ in range(3)]
    report = {
        "rows": [[row for batch in step for row in batch.input_ids.tolist()] for step in steps],
        "state": reader.state_dict(),
    }
    reader.close()
    (output_dir / f"rank_{dp.rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
