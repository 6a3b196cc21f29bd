"""The comparison sweep's results: rows from summaries (rows.py), the report files (report.py), the plots (plots.py)."""
