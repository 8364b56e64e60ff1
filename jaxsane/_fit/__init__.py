"""``fit``: the guarded, monitored training loop (``fit``, ``loop``: ``TrainLoop``), its arguments (``args``),
data and evaluation (``data``), checkpoints that survive damage (``checkpoint``), host copies of the state
(``state``), metric files (``metrics_log``), the checks it can run first (``prechecks``) and ``FitResult``.
"""
