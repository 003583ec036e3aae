"""A run's files: the run directory (``directory``: lock, config history, manifests, logs), the
metric sinks and progress bar (``metrics``), and the HTML report (``report``). This face imports
none of them: import the module you need."""
