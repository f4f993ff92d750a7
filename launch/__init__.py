"""`wideep` on the command line and over HTTP, by role: cli/, server/, chat/, tiny/
(python -m wideep.launch runs cli/cli.py's main)."""
