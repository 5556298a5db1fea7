"""The command-line tools: the benchmark (bench.py measures, bench_report.py reports,
bench_cli.py parses and runs; bench_procs.py runs one rank per process), the MoE layer
benchmark (bench_layer.py) and the soak (stress.py). `python -m ep_a2a.bench`,
`python -m ep_a2a.bench_layer` and `python -m ep_a2a.stress` run them."""
