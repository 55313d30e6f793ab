"""gpushare in front of a Slurm cluster (issue 39): Slurm runs and confines the jobs,
gpushare decides where and shows them. ``gateway`` presents each Slurm node as a gpushare
host, ``driver`` runs a sandbox as a Slurm job, ``rest`` talks to slurmrestd, ``model``
reads what it says. docs/slurm.md is the operator's side."""
