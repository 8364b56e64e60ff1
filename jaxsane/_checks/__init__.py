"""The single-purpose checks: gradients (``grads*``), init and the loss at init (``init*``), step wiring
(``step``), batch independence (``batch``) and sequence models (``sequence``).
"""
