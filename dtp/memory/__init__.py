"""Chapter 1, memory and compute: the closed forms (`formulas`: parameters, model states,
activations, FLOPs, MFU), what autograd really keeps (`activations`), one GPU's memory under any
layout (`calculator`), and the chapter's figure and notebook calculator (`plots`, `widgets`)."""
