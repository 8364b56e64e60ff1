"""What results look like: notebook reprs (``reprs``), plots, the one progress display, and the self-contained
HTML report (``html``). Host-side only.
"""
