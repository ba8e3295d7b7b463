"""Metrics (Prometheus) and traces (OpenTelemetry) of every Outrider process."""
