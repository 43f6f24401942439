"""Small files in the datasets' public formats, written by the data tests."""

import json

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def tsv(path, rows):
    pd.DataFrame(rows).to_csv(path, sep="\t", index=False)
    return path
