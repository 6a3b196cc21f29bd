"""parallel-sandbox: hand-written data, tensor and pipeline parallelism for one small GPT."""
