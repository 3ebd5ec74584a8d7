"""The per-pool autoscaler: its settings (``config``), the decision, a pure function
(``decision``), and the loop in the router actor that observes and sets targets (``runner``)."""
