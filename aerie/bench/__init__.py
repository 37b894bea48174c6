"""The benchmark's Ray-free parts: what to measure (`config`, `variants`), how (`load`: the
closed-loop streaming client; `peers`: Hugging Face `generate`), the metric maths (`metrics`,
`aggregate`), the lossless check (`lossless`), the winner (`selection`), and the report
(`report`, `plots`). `pipelines/benchmark.py` wires them into a Ray DAG."""
