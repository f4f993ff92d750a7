"""The `wideep` command line: its subcommands and flags, run-config files, the local rank spawner,
eplb-plan and eplb-report."""
