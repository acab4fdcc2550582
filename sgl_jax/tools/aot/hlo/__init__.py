"""The compiled step's optimized HLO text (``compiled.as_text()``), read for the report: its
parser (``parse``), each op's FLOPs and bytes (``op_costs``) and class (``op_classes``), the
per-class breakdown summing to XLA's totals (``breakdown``) and the interconnect bytes of its
collectives (``collectives``)."""
