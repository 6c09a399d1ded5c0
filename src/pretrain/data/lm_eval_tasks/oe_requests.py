"""lm-eval ``process_docs`` for the request files of data/tasks.py: one row per (document,
choice) in, one document per row out (``context``, ``choices``, ``label``, ``doc_id``).

Read by lm-eval itself (``!function oe_requests.process_docs`` in the YAMLs beside this
file), never imported by the package: it reads the JSON rows on its own, so the comparison
of tools/compare_lm_eval.py shares no code with data/tasks.py or data/task_scoring.py.
A choice is the continuation without its leading space, lm-eval's ``target_delimiter``:
``context + " " + choice`` is the scored text, as in the request file.
"""

from __future__ import annotations

UNCONDITIONED = 1_000_000  # doc_id offset of OLMo's unconditioned requests (not scored)


def process_docs(dataset):
    """The documents of ``dataset`` (rows of ``requests.jsonl``) in file order."""
    import datasets

    docs: dict[int, list[dict]] = {}
    for row in dataset:
        if int(row["doc_id"]) < UNCONDITIONED:
            docs.setdefault(int(row["doc_id"]), []).append(row)
    return datasets.Dataset.from_list([_document(k, rows) for k, rows in docs.items()])


def _document(doc_id: int, rows: list[dict]) -> dict:
    rows = sorted(rows, key=lambda r: r["idx"])
    contexts = {r["request"]["context"] for r in rows}
    conts = [r["request"]["continuation"] for r in rows]
    if len(contexts) != 1 or not all(c.startswith(" ") for c in conts):
        raise ValueError(f"document {doc_id}: lm-eval's multiple_choice needs one context "
                         "and continuations that start with its target delimiter ' '")
    return {"doc_id": doc_id, "context": contexts.pop(), "choices": [c[1:] for c in conts],
            "label": int(rows[0]["label"])}
