"""The training monitor: telemetry inside the compiled step (``monitor``), the ``train.*`` detectors that judge a
recorded ``History`` (``train_checks``), and metric writers (``writers``).
"""
