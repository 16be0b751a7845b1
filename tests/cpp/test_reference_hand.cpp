// Tiny problems whose results are computed by hand in the comments.
#include <cmath>
#include <limits>

#include "reference_problem.h"

namespace flash_dmattn::test {
namespace {

const double kInf = std::numeric_limits<double>::infinity();
const double e = std::exp(1.0);

// One query row, keys k = [1, 2], values v = [10, 20], D = 1, scale 1: z = [1, 2].
struct TwoKeys {
  HostTensor q = HostTensor::empty(DType::float64, {1, 1, 1, 1});
  HostTensor k = HostTensor::empty(DType::float64, {1, 2, 1, 1});
  HostTensor v = HostTensor::empty(DType::float64, {1, 2, 1, 1});
  TwoKeys() {
    q.set(0, 1.0);
    k.set(0, 1.0);
    k.set(1, 2.0);
    v.set(0, 10.0);
    v.set(1, 20.0);
  }
  reference::Inputs inputs() const {
    reference::Inputs in;
    in.q = q.view;
    in.k = k.view;
    in.v = v.view;
    in.scale = 1.0;
    return in;
  }
};

TEST(ReferenceHand, SoftmaxOfTwoKeys) {
  // P = [e, e²] / (e + e²) = [1, e] / (1 + e); O = (10 + 20e)/(1 + e); LSE = log(e + e²).
  const TwoKeys t;
  const auto r = reference::forward(t.inputs());
  EXPECT_NEAR(r.out[0], (10 + 20 * e) / (1 + e), 1e-13);
  EXPECT_NEAR(r.lse[0], std::log(e + e * e), 1e-13);
}

TEST(ReferenceHand, BiasIsAddedAfterScale) {
  // scale 2: s·qk = [2, 4]; bias [1, -1] is not scaled: z = [3, 3] -> P = [1/2, 1/2], O = 15, LSE = 3 + log 2.
  const TwoKeys t;
  HostTensor bias = HostTensor::empty(DType::float64, {1, 1, 1, 2});
  bias.set(0, 1.0);
  bias.set(1, -1.0);
  auto in = t.inputs();
  in.scale = 2.0;
  in.bias = &bias.view;
  const auto r = reference::forward(in);
  EXPECT_NEAR(r.out[0], 15.0, 1e-13);
  EXPECT_NEAR(r.lse[0], 3.0 + std::log(2.0), 1e-13);
}

TEST(ReferenceHand, SoftcapBeforeBias) {
  // cap 1: z = tanh([1, 2]) + bias [0.5, 0]; P ∝ exp(z).
  const TwoKeys t;
  HostTensor bias = HostTensor::empty(DType::float64, {1, 1, 1, 2});
  bias.set(0, 0.5);
  auto in = t.inputs();
  in.softcap = 1.0;
  in.bias = &bias.view;
  const double z0 = std::tanh(1.0) + 0.5, z1 = std::tanh(2.0);
  const double p0 = std::exp(z0) / (std::exp(z0) + std::exp(z1));
  const auto r = reference::forward(in);
  EXPECT_NEAR(r.out[0], 10 * p0 + 20 * (1 - p0), 1e-13);
  EXPECT_NEAR(r.lse[0], std::log(std::exp(z0) + std::exp(z1)), 1e-13);
}

TEST(ReferenceHand, MaskDropsAKey) {
  // mask [1, 0]: only key 0 is visible: O = v0 = 10, LSE = z0 = 1.
  const TwoKeys t;
  HostTensor mask = HostTensor::empty(DType::boolean, {1, 1, 1, 2});
  mask.set(0, 1.0);
  auto in = t.inputs();
  in.mask = &mask.view;
  const auto r = reference::forward(in);
  EXPECT_EQ(r.out[0], 10.0);
  EXPECT_EQ(r.lse[0], 1.0);
}

TEST(ReferenceHand, FullyMaskedRowIsZeroWithInfiniteLse) {
  const TwoKeys t;
  HostTensor mask = HostTensor::empty(DType::boolean, {1, 1, 1, 2});
  auto in = t.inputs();
  in.mask = &mask.view;
  const auto r = reference::forward(in);
  EXPECT_EQ(r.out[0], 0.0);
  EXPECT_EQ(r.lse[0], kInf);
}

TEST(ReferenceHand, MinusInfinityBiasEverywhereIsAnEmptyRow) {
  const TwoKeys t;
  HostTensor bias = HostTensor::empty(DType::float64, {1, 1, 1, 1});
  bias.set(0, -kInf);
  auto in = t.inputs();
  in.bias = &bias.view;
  const auto r = reference::forward(in);
  EXPECT_EQ(r.out[0], 0.0);
  EXPECT_EQ(r.lse[0], kInf);
}

TEST(ReferenceHand, CausalIsBottomRightAligned) {
  // Sq = 2, Sk = 3, q = 0 (all logits 0), v = [1, 2, 4]: row 0 sees keys j <= 0 + 3 - 2 = 1 -> O = 1.5;
  // row 1 sees all three -> O = 7/3.
  HostTensor q = HostTensor::empty(DType::float64, {1, 2, 1, 1});
  HostTensor k = HostTensor::empty(DType::float64, {1, 3, 1, 1});
  HostTensor v = HostTensor::empty(DType::float64, {1, 3, 1, 1});
  v.set(0, 1.0);
  v.set(1, 2.0);
  v.set(2, 4.0);
  reference::Inputs in{q.view, k.view, v.view};
  in.causal = true;
  const auto r = reference::forward(in);
  EXPECT_NEAR(r.out[0], 1.5, 1e-15);
  EXPECT_NEAR(r.out[1], 7.0 / 3.0, 1e-15);
  EXPECT_NEAR(r.lse[0], std::log(2.0), 1e-15);
  EXPECT_NEAR(r.lse[1], std::log(3.0), 1e-15);
}

TEST(ReferenceHand, CausalWithMoreQueriesThanKeysEmptiesTheFirstRows) {
  // Sq = 5, Sk = 2: row i sees j <= i - 3: rows 0-2 see nothing, row 3 sees key 0, row 4 both.
  HostTensor q = HostTensor::empty(DType::float64, {1, 5, 1, 1});
  HostTensor k = HostTensor::empty(DType::float64, {1, 2, 1, 1});
  HostTensor v = HostTensor::empty(DType::float64, {1, 2, 1, 1});
  v.set(0, 3.0);
  v.set(1, 5.0);
  reference::Inputs in{q.view, k.view, v.view};
  in.causal = true;
  const auto r = reference::forward(in);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(r.out[i], 0.0) << "row " << i;
    EXPECT_EQ(r.lse[i], kInf) << "row " << i;
  }
  EXPECT_EQ(r.out[3], 3.0);
  EXPECT_NEAR(r.out[4], 4.0, 1e-15);
}

TEST(ReferenceHand, GroupedQueryHeadsShareAKvHead) {
  // H = 2, Hk = 1: both query heads read the single KV head; with q head 1 = -q head 0 the
  // softmax weights mirror: O_0 = (10 + 20e)/(1 + e), O_1 = (10e + 20)/(1 + e).
  const TwoKeys t;
  HostTensor q = HostTensor::empty(DType::float64, {1, 1, 2, 1});
  q.set(0, 1.0);
  q.set(1, -1.0);
  auto in = t.inputs();
  in.q = q.view;
  HostTensor k = HostTensor::empty(DType::float64, {1, 2, 1, 1});  // k = [0, 1]: z = ±[0, 1]
  k.set(1, 1.0);
  in.k = k.view;
  const auto r = reference::forward(in);
  EXPECT_NEAR(r.out[0], (10 + 20 * e) / (1 + e), 1e-13);
  EXPECT_NEAR(r.out[1], (10 * e + 20) / (1 + e), 1e-13);
}

TEST(ReferenceHand, BackwardOfUniformAttention) {
  // q = 1, k = [0, 0] (z = 0, P = [1/2, 1/2]), v = [1, 3], dO = 1, scale 1.
  // O = 2; dP = [1, 3]; D = 2; dZ = P(dP - D) = [-1/2, 1/2]; dq = sum dZ·k = 0;
  // dk = dZ·q = [-1/2, 1/2]; dv = P·dO = [1/2, 1/2]; dbias (1,1,1,2) = dZ, (1,1,1,1) = 0.
  HostTensor q = HostTensor::empty(DType::float64, {1, 1, 1, 1});
  HostTensor k = HostTensor::empty(DType::float64, {1, 2, 1, 1});
  HostTensor v = HostTensor::empty(DType::float64, {1, 2, 1, 1});
  HostTensor dout = HostTensor::empty(DType::float64, {1, 1, 1, 1});
  HostTensor bias_keys = HostTensor::empty(DType::float64, {1, 1, 1, 2});
  HostTensor bias_scalar = HostTensor::empty(DType::float64, {1, 1, 1, 1});
  q.set(0, 1.0);
  v.set(0, 1.0);
  v.set(1, 3.0);
  dout.set(0, 1.0);
  reference::Inputs in{q.view, k.view, v.view};
  in.bias = &bias_keys.view;
  const auto g = reference::backward(in, dout.view);
  EXPECT_EQ(g.dq[0], 0.0);
  EXPECT_DOUBLE_EQ(g.dk[0], -0.5);
  EXPECT_DOUBLE_EQ(g.dk[1], 0.5);
  EXPECT_DOUBLE_EQ(g.dv[0], 0.5);
  EXPECT_DOUBLE_EQ(g.dv[1], 0.5);
  EXPECT_DOUBLE_EQ(g.dbias[0], -0.5);
  EXPECT_DOUBLE_EQ(g.dbias[1], 0.5);
  in.bias = &bias_scalar.view;
  EXPECT_DOUBLE_EQ(reference::backward(in, dout.view).dbias[0], 0.0);
}

TEST(ReferenceHand, SoftcapBackwardChainRule) {
  // One visible key pair with cap c: z_j = c·tanh(s·q·k_j/c); dS = dZ·s·(1 - tanh²).
  // q = 1, k = [0, 1], v = [0, 1], s = 1, c = 2, dO = 1: z = [0, 2 tanh(1/2)].
  HostTensor q = HostTensor::empty(DType::float64, {1, 1, 1, 1});
  HostTensor k = HostTensor::empty(DType::float64, {1, 2, 1, 1});
  HostTensor v = HostTensor::empty(DType::float64, {1, 2, 1, 1});
  HostTensor dout = HostTensor::empty(DType::float64, {1, 1, 1, 1});
  q.set(0, 1.0);
  k.set(1, 1.0);
  v.set(1, 1.0);
  dout.set(0, 1.0);
  reference::Inputs in{q.view, k.view, v.view};
  in.softcap = 2.0;
  const double t = std::tanh(0.5), z1 = 2 * t;
  const double p1 = std::exp(z1) / (1 + std::exp(z1)), p0 = 1 - p1;
  // dP = v = [0, 1]; D = p1; dZ = [p0(0 - p1), p1(1 - p1)]; dS_1 = dZ_1·(1 - t²); dq = dS_1·k_1.
  const double dz1 = p1 * (1 - p1);
  const auto g = reference::backward(in, dout.view);
  EXPECT_NEAR(g.dq[0], dz1 * (1 - t * t), 1e-15);
  EXPECT_NEAR(g.dk[1], dz1 * (1 - t * t), 1e-15);
  EXPECT_NEAR(g.dk[0], -p0 * p1, 1e-15);  // tanh'(0) = 1
}

}  // namespace
}  // namespace flash_dmattn::test
