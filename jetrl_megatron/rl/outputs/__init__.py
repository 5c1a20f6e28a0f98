"""What a run leaves on disk: metrics and plots (``metric_log``), ``summary.json`` (``summary``), and checkpoints
(``checkpoint_format``: the file format and reading one back; ``checkpoint_io``: saving, best-k, resuming)."""
