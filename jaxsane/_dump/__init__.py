"""Safe dumps of a failing step's inputs (``arrays.npz`` + ``tree.json``, no pickle): writing (``save``),
reading with limits (``dump``, ``npz``), the format's constants and Flax NNX objects in dumps.
"""
