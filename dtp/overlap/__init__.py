"""Chapter 7, overlapping communication with computation: the exposure model every chapter and the
planner use (`model`), the graded runs that record issue, wait and compute order (`runs`), and the
page's wall-clock measurements (`measure`)."""
