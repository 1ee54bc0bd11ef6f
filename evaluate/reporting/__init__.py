"""What an evaluation measured, as numbers, tables and plots.

metrics.py  counts summed over generations and the metrics derived from them (ratios of sums)
report.py   result records (results.jsonl), Markdown tables, plots
sweep.py    `specblock eval-report`: pool the records of an evaluation sweep
"""
