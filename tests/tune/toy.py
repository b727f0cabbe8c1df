"""A small lowered Relax module shaped like the model's: a `decode` function symbolic in the
batch b (role b = input_ids.shape[0]) calling a symbolic NT matmul and an elementwise kernel."""
from __future__ import annotations

from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T


@I.ir_module
class Toy:
    @T.prim_func(private=True, s_tir=True)
    def nt_matmul(x: T.handle, w: T.Buffer((T.int64(64), T.int64(32)), "float32"), y: T.handle):
        b = T.int64()
        X = T.match_buffer(x, (b, T.int64(32)), "float32")
        Y = T.match_buffer(y, (b, T.int64(64)), "float32")
        for i, j, k in T.grid(b, T.int64(64), T.int64(32)):
            with T.sblock("mm"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                with T.init():
                    Y[vi, vj] = T.float32(0)
                Y[vi, vj] = Y[vi, vj] + X[vi, vk] * w[vj, vk]

    @T.prim_func(private=True, s_tir=True)
    def relu(y: T.handle, z: T.handle):
        b = T.int64()
        Y = T.match_buffer(y, (b, T.int64(64)), "float32")
        Z = T.match_buffer(z, (b, T.int64(64)), "float32")
        for i, j in T.grid(b, T.int64(64)):
            with T.sblock("relu"):
                vi, vj = T.axis.remap("SS", [i, j])
                Z[vi, vj] = T.max(Y[vi, vj], T.float32(0))

    @R.function
    def decode(input_ids: R.Tensor(("b", 32), "float32"),
               w: R.Tensor((64, 32), "float32")) -> R.Tensor(("b", 64), "float32"):
        b = T.int64()
        R.func_attr({"num_input": 1, "tir_var_upper_bound": {"b": 8}})
        cls = Toy
        with R.dataflow():
            y = R.call_tir(cls.nt_matmul, (input_ids, w), out_ty=R.Tensor((b, 64), "float32"))
            z = R.call_tir(cls.relu, (y,), out_ty=R.Tensor((b, 64), "float32"))
            R.output(z)
        return z
