"""Exercise 4's 1F1B step, as the solution writes it, with the places where plausible variants
differ left open: `step(**changes)` fills them, each with the solution's own code unless
changed. Used by the pipeline checks' tests (tests/pp/test_pp_real_checks.py) and by the
measured bubble's test under load (tests/pp/test_pp_load.py)."""

STEP_TEMPLATE = '''
def one_f_one_b_step(stage, batch, targets, n_micro_batches, boundary_shape):
    rank, p, m = dist.get_rank(), dist.get_world_size(), n_micro_batches
    first, last = rank == 0, rank == p - 1
    inputs, labels = batch.tensor_split(m), targets.tensor_split(m)
    held, sending, loss = deque(), [], 0.0

    def forward(k):
        nonlocal loss
        if first:
            x = inputs[k]
        else:
            x = torch.empty(boundary_shape)
            dist.recv(x, rank - 1)
            x.requires_grad_()
        y = stage(x)
        if last:
            y = nn.functional.mse_loss(y, labels[k]){SCALE}
            loss += y.item()
        else:
            sending.append(dist.isend(y.detach(), rank + 1))
        held.append((x, y))

    def receive_gradient():
        gradient = torch.empty(boundary_shape)
        if not last:
            dist.recv(gradient, rank + 1)
        return gradient

    def backward(gradient):
        x, y = held.{POP}()
        if last:
            y.backward()
        else:
            y.backward(gradient)
        if not first:
            sending.append(dist.isend(x.grad, rank - 1))

    warm_up = {WARM_UP}
    for k in range(warm_up):
        forward(k)
    for k in range(warm_up, m):
        {STEADY}
    {COOL_DOWN}
    for request in sending:
        request.wait()
    {END}
    return {RESULT}
'''
STEP_RIGHT = dict(SCALE=" / m", POP="popleft", WARM_UP="min(p - rank - 1, m)",
                  STEADY="forward(k)\n        backward(receive_gradient())",
                  COOL_DOWN="for _ in range(warm_up):\n        backward(receive_gradient())",
                  END="", RESULT="loss if last else None")


def step(**changes) -> str:
    """The source of a `one_f_one_b_step` cell: the solution's, with `changes` (names of
    STEP_RIGHT) in its open places."""
    return STEP_TEMPLATE.format(**{**STEP_RIGHT, **changes})
