"""The user's side of the contract: ``Experiment`` and its pure view ``PureExperiment`` (``contract``), reading
batches (``batches``), and the adapters that make NNX / Equinox / chex programs pure (``purify``, ``chex``).
"""
