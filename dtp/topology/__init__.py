"""Chapter 9, topology: ranks, groups and links of a multi-dimensional layout (`mesh`), the layout
planner (`planner`) and its step-time model (`costs`), the planner against published runs
(`validation`), a real DP x PP x TP training run (`training`), and the chapter's figures (`plots`)."""
