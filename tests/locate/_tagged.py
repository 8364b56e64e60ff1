"""Lines tagged ``# <name>`` in a test file: where a test expects locate to point."""

import os


def tag_finder(test_file: str):
    """``(path, line_of)`` for ``test_file``: its absolute path and a function from a tag to its one line."""
    path = os.path.abspath(test_file)
    with open(path) as fh:
        source = fh.read().splitlines()

    def line_of(tag: str) -> int:
        hits = [i + 1 for i, text in enumerate(source) if text.rstrip().endswith(f"# <{tag}>")]
        assert len(hits) == 1, tag
        return hits[0]

    return path, line_of
