"""``doctor``: the checklist as a pipeline of stages (``pipeline``) run on one ``Experiment`` (``doctor``), its
run stage (``run_stage``), its options (``options``) and how crashes become findings (``triage``). The top layer.
"""
