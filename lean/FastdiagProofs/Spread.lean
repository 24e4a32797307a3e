import FastdiagProofs.Entropy

/-!
# Entropy spread `σ_H`

`σ_H` is the population standard deviation (ddof = 0) of the head entropies `E_h`, where `E_h`
is the mean row entropy of head `h`.

Main results, for `x : ι → ℝ` over a non-empty finite type:

* `popStd_nonneg`: `0 ≤ σ`.
* `popStd_eq_zero_iff`: `σ = 0` iff all values are equal.
* `popVariance_le_sq_half_range`: Popoviciu, `Var ≤ ((M - m) / 2)²` when `m ≤ x i ≤ M`.
* `popStd_le_half_range`: `σ ≤ (M - m) / 2`.

Applied to attention heads:

* `headEntropy_nonneg`, `headEntropy_le_log_card`: `0 ≤ E_h ≤ log Tk`.
* `entropySpread_le_half_log_card`: `σ_H ≤ (log Tk) / 2`.
* `entropySpread_eq_zero_of_forall_eq`: identical heads give `σ_H = 0`.
-/

noncomputable section

namespace FastdiagProofs

section PopStd

variable {ι : Type*} [Fintype ι]

/-- Population variance (ddof = 0): the mean squared deviation from the mean. -/
def popVariance (x : ι → ℝ) : ℝ := mean fun i => (x i - mean x) ^ 2

/-- Population standard deviation (ddof = 0). -/
def popStd (x : ι → ℝ) : ℝ := Real.sqrt (popVariance x)

theorem popVariance_eq (x : ι → ℝ) :
    popVariance x = (Fintype.card ι : ℝ)⁻¹ * ∑ i, (x i - mean x) ^ 2 :=
  rfl

theorem popVariance_nonneg (x : ι → ℝ) : 0 ≤ popVariance x := by
  rw [popVariance_eq]
  exact mul_nonneg (inv_nonneg.mpr (Nat.cast_nonneg _))
    (Finset.sum_nonneg fun i _ => sq_nonneg (x i - mean x))

/-- The population standard deviation is non-negative. -/
theorem popStd_nonneg (x : ι → ℝ) : 0 ≤ popStd x :=
  Real.sqrt_nonneg _

/-- The population standard deviation is zero iff all values are equal. -/
theorem popStd_eq_zero_iff [Nonempty ι] (x : ι → ℝ) :
    popStd x = 0 ↔ ∀ i j, x i = x j := by
  have hc : (0 : ℝ) < Fintype.card ι := Nat.cast_pos.mpr Fintype.card_pos
  have hsq : ∀ i ∈ (Finset.univ : Finset ι), 0 ≤ (x i - mean x) ^ 2 :=
    fun i _ => sq_nonneg (x i - mean x)
  constructor
  · intro h
    unfold popStd at h
    have hv : popVariance x ≤ 0 := Real.sqrt_eq_zero'.mp h
    rw [popVariance_eq] at hv
    have hS : ∑ i, (x i - mean x) ^ 2 = 0 := by
      refine le_antisymm ?_ (Finset.sum_nonneg hsq)
      by_contra hlt
      push_neg at hlt
      have hpos := mul_pos (inv_pos.mpr hc) hlt
      linarith
    have hall := (Finset.sum_eq_zero_iff_of_nonneg hsq).mp hS
    have hxi : ∀ i, x i = mean x := fun i =>
      sub_eq_zero.mp ((pow_eq_zero_iff (n := 2) (by norm_num)).mp (hall i (Finset.mem_univ i)))
    intro i j
    rw [hxi i, hxi j]
  · intro h
    obtain ⟨i₀⟩ : Nonempty ι := inferInstance
    have hmean : mean x = x i₀ :=
      (congrArg mean (funext fun i => h i i₀ : x = fun _ => x i₀)).trans (mean_const (x i₀))
    have hS : ∑ i, (x i - mean x) ^ 2 = 0 :=
      Finset.sum_eq_zero fun i _ => by simp [hmean, h i i₀]
    have hv : popVariance x = 0 := by
      rw [popVariance_eq, hS, mul_zero]
    unfold popStd
    rw [hv, Real.sqrt_zero]

/-- **Popoviciu's inequality**: values in `[m, M]` have population variance at most
`((M - m) / 2) ^ 2`.  Proof: `0 ≤ ∑ (x i - m) (M - x i) = n (μ - m) (M - μ) - ∑ (x i - μ)²`. -/
theorem popVariance_le_sq_half_range [Nonempty ι] {x : ι → ℝ} {m M : ℝ}
    (hm : ∀ i, m ≤ x i) (hM : ∀ i, x i ≤ M) : popVariance x ≤ ((M - m) / 2) ^ 2 := by
  have hc : (0 : ℝ) < Fintype.card ι := Nat.cast_pos.mpr Fintype.card_pos
  have hkey : 0 ≤ ∑ i, (x i - m) * (M - x i) :=
    Finset.sum_nonneg fun i _ => mul_nonneg (sub_nonneg.mpr (hm i)) (sub_nonneg.mpr (hM i))
  -- Pointwise: `(x - m)(M - x) = (μ - m)(M - μ) + (M + m - 2μ)(x - μ) - (x - μ)²`.
  have hid : ∑ i, (x i - m) * (M - x i)
      = ∑ i, ((mean x - m) * (M - mean x) + (M + m - 2 * mean x) * (x i - mean x)
          - (x i - mean x) ^ 2) :=
    Finset.sum_congr rfl fun i _ => by ring
  rw [Finset.sum_sub_distrib, Finset.sum_add_distrib, Finset.sum_const, Finset.card_univ,
    nsmul_eq_mul, ← Finset.mul_sum, sum_sub_mean x, mul_zero, add_zero] at hid
  have hS : ∑ i, (x i - mean x) ^ 2
      ≤ (Fintype.card ι : ℝ) * ((mean x - m) * (M - mean x)) := by
    linarith
  rw [popVariance_eq]
  calc (Fintype.card ι : ℝ)⁻¹ * ∑ i, (x i - mean x) ^ 2
      ≤ (Fintype.card ι : ℝ)⁻¹ * ((Fintype.card ι : ℝ) * ((mean x - m) * (M - mean x))) :=
        mul_le_mul_of_nonneg_left hS (inv_nonneg.mpr hc.le)
    _ = (mean x - m) * (M - mean x) := inv_mul_cancel_left₀ hc.ne' _
    _ ≤ ((M - m) / 2) ^ 2 := by nlinarith [sq_nonneg (mean x - m - (M - mean x))]

/-- Values in `[m, M]` have population standard deviation at most `(M - m) / 2`. -/
theorem popStd_le_half_range [Nonempty ι] {x : ι → ℝ} {m M : ℝ}
    (hm : ∀ i, m ≤ x i) (hM : ∀ i, x i ≤ M) : popStd x ≤ (M - m) / 2 := by
  obtain ⟨i₀⟩ : Nonempty ι := inferInstance
  have hmM : 0 ≤ (M - m) / 2 := by linarith [hm i₀, hM i₀]
  calc popStd x = Real.sqrt (popVariance x) := rfl
    _ ≤ Real.sqrt (((M - m) / 2) ^ 2) :=
        Real.sqrt_le_sqrt (popVariance_le_sq_half_range hm hM)
    _ = (M - m) / 2 := Real.sqrt_sq hmM

/-- Values in `[0, L]` have population standard deviation at most `L / 2`. -/
theorem popStd_le_half_of_mem_Icc [Nonempty ι] {x : ι → ℝ} {L : ℝ}
    (h0 : ∀ i, 0 ≤ x i) (hL : ∀ i, x i ≤ L) : popStd x ≤ L / 2 := by
  have h := popStd_le_half_range h0 hL
  rwa [sub_zero] at h

end PopStd

section Heads

variable {η ρ κ : Type*} [Fintype η] [Fintype ρ] [Fintype κ]

/-- `E_h`: the mean, over rows `r`, of the row entropies of one head (`P r` is row `r`). -/
def headEntropy (P : ρ → κ → ℝ) : ℝ := mean fun r => entropy (P r)

/-- `σ_H`: population standard deviation of the head entropies (`P h r` is row `r` of head `h`). -/
def entropySpread (P : η → ρ → κ → ℝ) : ℝ := popStd fun h => headEntropy (P h)

theorem headEntropy_nonneg [Nonempty ρ] {P : ρ → κ → ℝ} (hP : ∀ r, IsProbVec (P r)) :
    0 ≤ headEntropy P := by
  unfold headEntropy
  exact le_mean fun r => entropy_nonneg (hP r)

theorem headEntropy_le_log_card [Nonempty ρ] {P : ρ → κ → ℝ} (hP : ∀ r, IsProbVec (P r)) :
    headEntropy P ≤ Real.log (Fintype.card κ) := by
  unfold headEntropy
  exact mean_le fun r => entropy_le_log_card (hP r)

theorem entropySpread_nonneg (P : η → ρ → κ → ℝ) : 0 ≤ entropySpread P :=
  popStd_nonneg _

/-- `σ_H ≤ (log Tk) / 2`, where `Tk = Fintype.card κ` is the number of keys. -/
theorem entropySpread_le_half_log_card [Nonempty η] [Nonempty ρ] {P : η → ρ → κ → ℝ}
    (hP : ∀ h r, IsProbVec (P h r)) :
    entropySpread P ≤ Real.log (Fintype.card κ) / 2 := by
  unfold entropySpread
  exact popStd_le_half_of_mem_Icc (fun h => headEntropy_nonneg (hP h))
    (fun h => headEntropy_le_log_card (hP h))

theorem entropySpread_eq_zero_iff [Nonempty η] (P : η → ρ → κ → ℝ) :
    entropySpread P = 0 ↔ ∀ h h', headEntropy (P h) = headEntropy (P h') := by
  unfold entropySpread
  exact popStd_eq_zero_iff _

/-- Heads with identical patterns give `σ_H = 0`. -/
theorem entropySpread_eq_zero_of_forall_eq [Nonempty η] {P : η → ρ → κ → ℝ}
    (hP : ∀ h h', P h = P h') : entropySpread P = 0 :=
  (entropySpread_eq_zero_iff P).mpr fun h h' => by rw [hP h h']

end Heads

end FastdiagProofs

end
