"""hicache's own storage backends. Each is registered in the ``hicache.backends`` entry-point
group exactly as a third-party plugin is; hicache's core never imports this package."""
