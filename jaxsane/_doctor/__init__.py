"""``doctor``: the checklist as a pipeline of stages (``pipeline``) run on one ``Experiment`` (``doctor``), its
grads and run stages (``grads_stage``, ``run_stage``), the plan of a large step (``budget``), its options
(``options``) and how crashes become findings (``triage``). The top layer.
"""
